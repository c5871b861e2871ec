//! The Noise layer of host links and data connections, sans I/O: the handshake's steps,
//! the identity each side announces in it, and the record layer (length-prefixed Noise
//! transport messages) that carries Baton's frames once it is done.
//!
//! Pattern `Noise_XXpsk0_25519_ChaChaPoly_BLAKE2s`: both sides send their static keys
//! (encrypted), and the pre-shared key — derived from the session token — is mixed in
//! from the first message, so only a holder of the token completes the handshake.
//!
//! Why `psk0` (issue 45, finding 12): nothing identifying may reach a peer before it has
//! proven the token. With `psk3` the token was checked only at the third message, so the
//! responder's second message — its static key, host id, boot id, pid, start time and
//! data port, encrypted under keys any initiator could derive from its own ephemeral key —
//! was readable by anyone who connected. With `psk0` the initiator's first message carries
//! an AEAD tag under a key that mixes in the pre-shared key: a peer without the token is
//! refused at that first message (`BadToken`, a refusal record and nothing else), and the
//! responder's second message is encrypted under keys that need both the token and the
//! initiator's ephemeral private key, so a replayed first message (captured from an
//! honest peer) gets back only bytes its sender cannot read. The alternative, sending the
//! responder's claim after the third message, would have left its static key readable by
//! any token-less initiator, and cost a round trip of framing of its own. Symmetrically,
//! the initiator's key and claim travel in the third message, after it has checked the
//! responder's second (which only a token holder can make). A record is a
//! 2-byte big-endian length and that many bytes of Noise message (at most 65,535). A
//! record of length 0 is a refusal: one reason byte follows, in clear (it can only make a
//! peer give up, which anyone on the path could do by closing).

use super::{HostId, TcpConfig, TcpPolicy};
use crate::session::Session;
use crate::{Error, Result};
use baton_messages::codec::FrameDecoder;
use baton_messages::protocol::RefuseReason;
use baton_messages::{BootId, Message, ProcessId};
use snow::{HandshakeState, StatelessTransportState};
use std::sync::Arc;

/// The Noise protocol name.
pub(crate) const PATTERN: &str = "Noise_XXpsk0_25519_ChaChaPoly_BLAKE2s";
/// The longest Noise message.
pub(crate) const MAX_RECORD: usize = 65_535;
/// The AEAD tag each transport message carries.
const TAG: usize = 16;
/// The most plaintext one record carries.
pub(crate) const MAX_PLAINTEXT: usize = MAX_RECORD - TAG;
/// The length prefix of a record.
pub(crate) const PREFIX: usize = 2;

/// The pre-shared key of a session: a key derived from its token (the raw token is never
/// a cipher key).
pub(crate) fn psk(session: &Session) -> [u8; 32] {
    blake3::derive_key("baton tcp psk v1", session.token().as_bytes())
}

pub(crate) fn params() -> snow::params::NoiseParams {
    PATTERN.parse().expect("a valid Noise pattern")
}

/// What each side announces, encrypted, in its handshake message: its host and process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) host: HostId,
    pub(crate) process: ProcessId,
    /// The port its TCP engine takes data connections on, at the address the link runs
    /// over (0: it has none).
    pub(crate) data_port: u16,
}

const CLAIM_LEN: usize = 32 + 16 + 4 + 8 + 2;

impl Claim {
    pub(crate) fn of(config: &TcpConfig) -> Claim {
        Claim {
            host: config.host,
            process: config.session.process(),
            data_port: config.data_port.unwrap_or(0),
        }
    }

    fn to_bytes(self) -> [u8; CLAIM_LEN] {
        let mut out = [0u8; CLAIM_LEN];
        out[..32].copy_from_slice(&self.host.0);
        out[32..48].copy_from_slice(&self.process.boot.0);
        out[48..52].copy_from_slice(&self.process.pid.to_le_bytes());
        out[52..60].copy_from_slice(&self.process.start_ticks.to_le_bytes());
        out[60..].copy_from_slice(&self.data_port.to_le_bytes());
        out
    }

    fn parse(bytes: &[u8]) -> Result<Claim> {
        if bytes.len() != CLAIM_LEN {
            return Err(Error::Refused {
                reason: RefuseReason::ProtocolViolation,
            });
        }
        let mut host = [0u8; 32];
        host.copy_from_slice(&bytes[..32]);
        let mut boot = [0u8; 16];
        boot.copy_from_slice(&bytes[32..48]);
        Ok(Claim {
            host: HostId(host),
            process: ProcessId {
                boot: BootId(boot),
                pid: u32::from_le_bytes(bytes[48..52].try_into().expect("4 bytes")),
                start_ticks: u64::from_le_bytes(bytes[52..60].try_into().expect("8 bytes")),
            },
            data_port: u16::from_le_bytes(bytes[60..].try_into().expect("2 bytes")),
        })
    }
}

fn reason_byte(reason: RefuseReason) -> u8 {
    match reason {
        RefuseReason::BadToken => 1,
        RefuseReason::NotAllowed => 2,
        RefuseReason::TooManyLinks => 4,
        _ => 3,
    }
}

fn reason_of(byte: u8) -> RefuseReason {
    match byte {
        1 => RefuseReason::BadToken,
        2 => RefuseReason::NotAllowed,
        4 => RefuseReason::TooManyLinks,
        _ => RefuseReason::ProtocolViolation,
    }
}

/// The record that refuses the peer, with its reason.
pub(crate) fn refusal_record(reason: RefuseReason) -> [u8; 3] {
    [0, 0, reason_byte(reason)]
}

/// Appends `msg` as one record.
fn push_record(msg: &[u8], out: &mut Vec<u8>) {
    let len = u16::try_from(msg.len()).expect("a Noise message fits a record");
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(msg);
}

/// One complete record at the front of `buf`: `Ok(Some(len))` (the record's body is
/// `buf[PREFIX..PREFIX + len]`), `Ok(None)` if more bytes are needed.
///
/// # Errors
/// [`Error::Refused`] for a refusal record.
pub(crate) fn record_at(buf: &[u8]) -> Result<Option<usize>> {
    if buf.len() < PREFIX {
        return Ok(None);
    }
    let len = usize::from(u16::from_be_bytes([buf[0], buf[1]]));
    if len == 0 {
        return match buf.get(PREFIX) {
            Some(&b) => Err(Error::Refused {
                reason: reason_of(b),
            }),
            None => Ok(None),
        };
    }
    Ok((buf.len() >= PREFIX + len).then_some(len))
}

/// The outcome of a handshake: the keys of the channel, who the peer is, its static key.
#[derive(Debug)]
pub(crate) struct Established {
    pub(crate) transport: Arc<StatelessTransportState>,
    pub(crate) claim: Claim,
    pub(crate) remote_key: [u8; 32],
    /// The handshake hash: binds keys derived later (a transfer's MAC key) to this channel.
    pub(crate) hash: [u8; 32],
}

impl Established {
    /// The peer's process as this node knows it: its claim in its key's namespace
    /// ([`remote_process`](crate::identity::remote_process)).
    pub(crate) fn process(&self) -> ProcessId {
        crate::identity::remote_process(&super::NodePublicKey(self.remote_key), self.claim.process)
    }
}

/// One side of a Noise handshake in progress.
#[derive(Debug)]
pub(crate) struct Handshake {
    state: HandshakeState,
    policy: TcpPolicy,
    me: Claim,
    peer: Option<Claim>,
}

fn tampered(what: &'static str) -> impl FnOnce(snow::Error) -> Error {
    move |_| Error::Tampered { what }
}

impl Handshake {
    fn new(config: &TcpConfig, initiator: bool) -> Result<Handshake> {
        let psk = psk(&config.session);
        let builder = snow::Builder::new(params())
            .local_private_key(config.key.private())
            .and_then(|b| b.psk(0, &psk))
            .map_err(|e| Error::Io {
                op: "setting up a Noise handshake",
                source: std::io::Error::other(e),
            })?;
        let state = if initiator {
            builder.build_initiator()
        } else {
            builder.build_responder()
        }
        .map_err(|e| Error::Io {
            op: "setting up a Noise handshake",
            source: std::io::Error::other(e),
        })?;
        Ok(Handshake {
            state,
            policy: config.policy.clone(),
            me: Claim::of(config),
            peer: None,
        })
    }

    /// The initiator (client): its first record, to send.
    pub(crate) fn initiator(config: &TcpConfig) -> Result<(Handshake, Vec<u8>)> {
        let mut hs = Self::new(config, true)?;
        let out = hs.write(&[])?;
        Ok((hs, out))
    }

    /// The responder (server).
    pub(crate) fn responder(config: &TcpConfig) -> Result<Self> {
        Self::new(config, false)
    }

    fn write(&mut self, payload: &[u8]) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; MAX_RECORD];
        let n = self
            .state
            .write_message(payload, &mut buf)
            .map_err(|e| Error::Io {
                op: "writing a Noise handshake message",
                source: std::io::Error::other(e),
            })?;
        let mut out = Vec::with_capacity(PREFIX + n);
        push_record(&buf[..n], &mut out);
        Ok(out)
    }

    fn read(&mut self, record: &[u8], what: &'static str) -> Result<Vec<u8>> {
        let mut payload = vec![0u8; MAX_RECORD];
        let n = self
            .state
            .read_message(record, &mut payload)
            .map_err(tampered(what))?;
        payload.truncate(n);
        Ok(payload)
    }

    /// The peer's static key, checked against the pinned set.
    fn check_key(&self) -> Result<(), (Error, RefuseReason)> {
        let key = self.state.get_remote_static().unwrap_or(&[]);
        self.policy
            .check(key)
            .map_err(|e| (e, RefuseReason::NotAllowed))
    }

    /// The peer's static key (zeros before it was received).
    pub(crate) fn remote_key(&self) -> [u8; 32] {
        let mut key = [0u8; 32];
        if let Some(k) = self.state.get_remote_static() {
            key.copy_from_slice(k);
        }
        key
    }

    /// Responder: takes the initiator's first record; returns the second, to send.
    ///
    /// # Errors
    /// [`Error::BadToken`] if it does not check (the initiator holds another token, or the
    /// bytes were changed): nothing of ours is sent, only the refusal that comes back with
    /// the error.
    pub(crate) fn on_first(&mut self, record: &[u8]) -> Result<Vec<u8>, (Error, RefuseReason)> {
        self.read(record, "first handshake message")
            .map_err(|_| (Error::BadToken, RefuseReason::BadToken))?;
        let me = self.me.to_bytes();
        self.write(&me)
            .map_err(|e| (e, RefuseReason::ProtocolViolation))
    }

    /// Initiator: takes the responder's record; returns the third, to send.
    ///
    /// # Errors
    /// A refusal to send (the responder's key is not pinned) comes back with its reason.
    pub(crate) fn on_second(&mut self, record: &[u8]) -> Result<Vec<u8>, (Error, RefuseReason)> {
        let payload = self
            .read(record, "second handshake message")
            .map_err(|e| (e, RefuseReason::ProtocolViolation))?;
        self.peer = Some(Claim::parse(&payload).map_err(|e| (e, RefuseReason::ProtocolViolation))?);
        self.check_key()?;
        let me = self.me.to_bytes();
        self.write(&me)
            .map_err(|e| (e, RefuseReason::ProtocolViolation))
    }

    /// Responder: takes the initiator's last record.
    ///
    /// # Errors
    /// [`Error::BadToken`] if it does not decrypt (its bytes were changed on the way, or
    /// its sender is not the token holder that sent the first); the refusal to send comes
    /// back with the error.
    pub(crate) fn on_third(&mut self, record: &[u8]) -> Result<(), (Error, RefuseReason)> {
        let payload = self
            .read(record, "third handshake message")
            .map_err(|_| (Error::BadToken, RefuseReason::BadToken))?;
        self.peer = Some(Claim::parse(&payload).map_err(|e| (e, RefuseReason::ProtocolViolation))?);
        self.check_key()
    }

    /// The finished handshake's channel.
    pub(crate) fn finish(self) -> Result<Established> {
        let claim = self.peer.ok_or(Error::Refused {
            reason: RefuseReason::ProtocolViolation,
        })?;
        let mut remote_key = [0u8; 32];
        remote_key.copy_from_slice(self.state.get_remote_static().unwrap_or(&[0; 32]));
        let mut hash = [0u8; 32];
        hash.copy_from_slice(&self.state.get_handshake_hash()[..32]);
        let transport = self
            .state
            .into_stateless_transport_mode()
            .map_err(|e| Error::Io {
                op: "finishing a Noise handshake",
                source: std::io::Error::other(e),
            })?;
        Ok(Established {
            transport: Arc::new(transport),
            claim,
            remote_key,
            hash,
        })
    }
}

/// The sending half of an established channel: frames in, records out.
#[derive(Debug)]
pub(crate) struct Sealer {
    state: Arc<StatelessTransportState>,
    nonce: u64,
    scratch: Vec<u8>,
}

impl Sealer {
    pub(crate) fn new(state: Arc<StatelessTransportState>) -> Self {
        Self {
            state,
            nonce: 0,
            scratch: vec![0u8; MAX_RECORD],
        }
    }

    /// Appends `plain` (any bytes: encoded frames, a header) to `out` as records.
    pub(crate) fn seal(&mut self, plain: &[u8], out: &mut Vec<u8>) -> Result<()> {
        for chunk in plain.chunks(MAX_PLAINTEXT) {
            let n = self
                .state
                .write_message(self.nonce, chunk, &mut self.scratch)
                .map_err(|e| Error::Io {
                    op: "encrypting a Noise message",
                    source: std::io::Error::other(e),
                })?;
            self.nonce += 1;
            push_record(&self.scratch[..n], out);
        }
        Ok(())
    }
}

/// The receiving half of an established channel: records in, plaintext out. The records
/// are decrypted in place of order; a record that does not decrypt (changed, replayed,
/// reordered) is [`Error::Tampered`].
#[derive(Debug)]
pub(crate) struct Opener {
    state: Arc<StatelessTransportState>,
    nonce: u64,
    /// Received ciphertext in `cipher[start..end]`.
    cipher: Vec<u8>,
    start: usize,
    end: usize,
}

impl Opener {
    pub(crate) fn new(state: Arc<StatelessTransportState>) -> Self {
        Self {
            state,
            nonce: 0,
            cipher: vec![0u8; 2 * (MAX_RECORD + PREFIX)],
            start: 0,
            end: 0,
        }
    }

    /// Where to receive ciphertext; then [`commit`](Self::commit) what was written.
    pub(crate) fn spare(&mut self) -> &mut [u8] {
        if self.start > 0 && self.cipher.len() - self.end < MAX_RECORD + PREFIX {
            self.cipher.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        &mut self.cipher[self.end..]
    }

    pub(crate) fn commit(&mut self, n: usize) {
        self.end += n;
    }

    /// Ciphertext received and not yet opened.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Takes up to `out.len()` bytes received but not opened, as they are (the clear
    /// bytes that follow a record, such as a transfer's payload).
    pub(crate) fn take_raw(&mut self, out: &mut [u8]) -> usize {
        let n = out.len().min(self.buffered());
        out[..n].copy_from_slice(&self.cipher[self.start..self.start + n]);
        self.start += n;
        n
    }

    /// Opens the next complete record into `out` (at least [`MAX_RECORD`] bytes):
    /// `Ok(Some(n))` plaintext bytes, `Ok(None)` if more ciphertext is needed.
    ///
    /// # Errors
    /// [`Error::Tampered`]; [`Error::Refused`] for a refusal record.
    pub(crate) fn open(&mut self, out: &mut [u8]) -> Result<Option<usize>> {
        let Some(len) = record_at(&self.cipher[self.start..self.end])? else {
            return Ok(None);
        };
        let body = &self.cipher[self.start + PREFIX..self.start + PREFIX + len];
        let n = self
            .state
            .read_message(self.nonce, body, out)
            .map_err(tampered("transport message"))?;
        self.nonce += 1;
        self.start += PREFIX + len;
        Ok(Some(n))
    }

    /// Opens every complete record into `decoder`, then returns its next frame, if any.
    /// A frame that announces descriptors is refused (none can cross TCP).
    ///
    /// # Errors
    /// As [`open`](Self::open); a frame error; [`Error::MissingFds`].
    pub(crate) fn next_message(&mut self, decoder: &mut FrameDecoder) -> Result<Option<Message>> {
        loop {
            if let Some(frame) = decoder.next_frame()? {
                if frame.header.nfds != 0 {
                    return Err(Error::MissingFds {
                        need: usize::from(frame.header.nfds),
                        have: 0,
                    });
                }
                return Ok(Some(frame.message));
            }
            let spare = decoder.spare(MAX_RECORD);
            match self.open(spare)? {
                Some(n) => decoder.commit(n),
                None => return Ok(None),
            }
        }
    }

    /// At end of stream: a record or frame cut off is an error, a clean end is
    /// [`Error::Closed`].
    pub(crate) fn at_eof(&self, decoder: &FrameDecoder) -> Error {
        if self.buffered() > 0 {
            return Error::Message(baton_messages::Error::Truncated {
                have: self.buffered(),
                need: self.buffered() + 1,
            });
        }
        match decoder.finish() {
            Ok(()) => Error::Closed,
            Err(e) => Error::Message(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tcp::NodeKey;
    use baton_messages::SessionToken;

    fn session(b: u8) -> Session {
        Session::new(SessionToken::from_bytes([b; 32]))
    }

    fn body(record: &[u8]) -> &[u8] {
        let len = record_at(record).unwrap().unwrap();
        &record[PREFIX..PREFIX + len]
    }

    type Outcome = Result<(Handshake, Handshake), (Error, RefuseReason)>;

    fn run(client: &Session, server: &Session) -> Outcome {
        let host = HostId::named("test");
        let config = |session: &Session| {
            TcpConfig::new(session.clone(), NodeKey::generate().unwrap()).host(host)
        };
        let (mut c, first) = Handshake::initiator(&config(client)).unwrap();
        let mut s = Handshake::responder(&config(server)).unwrap();
        let second = s.on_first(body(&first))?;
        let third = c.on_second(body(&second)).unwrap();
        s.on_third(body(&third))?;
        Ok((c, s))
    }

    #[test]
    fn matching_tokens_complete_and_frames_cross_in_records() {
        let (c, s) = run(&session(1), &session(1)).unwrap();
        let (c, s) = (c.finish().unwrap(), s.finish().unwrap());
        assert_eq!(c.claim.process, crate::process::current());
        assert_eq!(c.hash, s.hash);
        let mut sealer = Sealer::new(c.transport);
        let mut opener = Opener::new(s.transport);
        let mut wire = Vec::new();
        let frame = baton_messages::codec::frame_bytes(&Message::Ping(9), 0).unwrap();
        sealer.seal(&frame, &mut wire).unwrap();
        opener.spare()[..wire.len()].copy_from_slice(&wire);
        opener.commit(wire.len());
        let mut decoder = FrameDecoder::new();
        assert_eq!(
            opener.next_message(&mut decoder).unwrap(),
            Some(Message::Ping(9))
        );
    }

    #[test]
    fn a_wrong_token_fails_at_the_first_message_as_bad_token() {
        let Err((e, reason)) = run(&session(1), &session(2)) else {
            panic!("a wrong token completed the handshake");
        };
        assert!(matches!(e, Error::BadToken), "{e}");
        assert_eq!(reason, RefuseReason::BadToken);
    }

    #[test]
    fn a_refusal_record_reads_as_its_reason() {
        let r = refusal_record(RefuseReason::NotAllowed);
        assert!(matches!(
            record_at(&r),
            Err(Error::Refused {
                reason: RefuseReason::NotAllowed
            })
        ));
        assert!(matches!(record_at(&r[..2]), Ok(None)));
    }
}
