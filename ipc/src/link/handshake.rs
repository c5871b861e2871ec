//! The link handshake, sans I/O: each step takes the peer's message and returns ours.
//!
//! Both sides prove they hold the session token with a keyed digest over both nonces and
//! their own identity; the token itself never travels. Each side also checks that the
//! identity the peer claims is the process the kernel says is connected.

use super::creds::KernelPeer;
use crate::session::{Role, Session};
use crate::{Error, Result};
use baton_messages::protocol::{Auth, Hello, Nonce, RefuseReason, Refused, Welcome};
use baton_messages::{Message, PROTOCOL_VERSION, ProcessId};

/// A failed step: the error to report, and the reason to send the peer (if any) in a
/// `Refused` before closing.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) error: Error,
    pub(crate) reason: Option<RefuseReason>,
}

impl Refusal {
    pub(crate) fn new(error: Error, reason: RefuseReason) -> Self {
        Self {
            error,
            reason: Some(reason),
        }
    }

    /// The message that tells the peer why, if it should be told.
    pub(crate) fn reply(&self) -> Option<Message> {
        self.reason
            .map(|reason| Message::Refused(Refused { reason }))
    }

    fn silent(error: Error) -> Self {
        Self {
            error,
            reason: None,
        }
    }
}

impl From<Error> for Refusal {
    fn from(error: Error) -> Self {
        Refusal::silent(error)
    }
}

fn unexpected(expected: &'static str, got: &Message) -> Refusal {
    match got {
        Message::Refused(r) => Refusal::silent(Error::Refused { reason: r.reason }),
        other => Refusal::new(
            Error::UnexpectedMessage {
                expected,
                got: other.kind(),
            },
            RefuseReason::ProtocolViolation,
        ),
    }
}

fn check_version(version: u8) -> Result<(), Refusal> {
    if version == PROTOCOL_VERSION {
        Ok(())
    } else {
        Err(Refusal::new(
            baton_messages::Error::UnsupportedVersion {
                got: version,
                supported: PROTOCOL_VERSION,
            }
            .into(),
            RefuseReason::VersionMismatch {
                supported: PROTOCOL_VERSION,
            },
        ))
    }
}

fn check_claim(peer: &KernelPeer, claimed: &ProcessId) -> Result<(), Refusal> {
    peer.verify_claim(claimed)
        .map_err(|e| Refusal::new(e, RefuseReason::ProtocolViolation))
}

/// The client, after sending `Hello`.
#[derive(Debug)]
pub(crate) struct ClientHandshake {
    nonce: Nonce,
}

impl ClientHandshake {
    /// Starts: the `Hello` to send.
    pub(crate) fn start(session: &Session) -> Result<(Self, Message)> {
        let nonce = Nonce(crate::session::random_bytes()?);
        let hello = Message::Hello(Hello {
            version: PROTOCOL_VERSION,
            process: session.process(),
            nonce,
        });
        Ok((Self { nonce }, hello))
    }

    /// Takes the server's `Welcome`: the `Auth` to send, and who the server is.
    pub(crate) fn on_welcome(
        self,
        session: &Session,
        peer: &KernelPeer,
        msg: Message,
    ) -> Result<(Message, ProcessId), Refusal> {
        let Message::Welcome(w) = msg else {
            return Err(unexpected("Welcome", &msg));
        };
        check_version(w.version)?;
        check_claim(peer, &w.process)?;
        if !session.check_proof(Role::Server, &self.nonce, &w.nonce, &w.process, &w.proof) {
            return Err(Refusal::new(Error::BadToken, RefuseReason::BadToken));
        }
        let proof = session.proof(Role::Client, &self.nonce, &w.nonce, &session.process());
        Ok((Message::Auth(Auth { proof }), w.process))
    }
}

/// The server, after answering `Hello` with `Welcome`.
#[derive(Debug)]
pub(crate) struct ServerHandshake {
    client_nonce: Nonce,
    server_nonce: Nonce,
    client: ProcessId,
}

impl ServerHandshake {
    /// Takes the client's `Hello`: the `Welcome` to send.
    pub(crate) fn on_hello(
        session: &Session,
        peer: &KernelPeer,
        msg: Message,
    ) -> Result<(Self, Message), Refusal> {
        let Message::Hello(h) = msg else {
            return Err(unexpected("Hello", &msg));
        };
        check_version(h.version)?;
        check_claim(peer, &h.process)?;
        let server_nonce = Nonce(crate::session::random_bytes()?);
        let me = session.process();
        let welcome = Message::Welcome(Welcome {
            version: PROTOCOL_VERSION,
            process: me,
            nonce: server_nonce,
            proof: session.proof(Role::Server, &h.nonce, &server_nonce, &me),
        });
        Ok((
            Self {
                client_nonce: h.nonce,
                server_nonce,
                client: h.process,
            },
            welcome,
        ))
    }

    /// Takes the client's `Auth`: who the client is.
    pub(crate) fn on_auth(self, session: &Session, msg: Message) -> Result<ProcessId, Refusal> {
        let Message::Auth(a) = msg else {
            return Err(unexpected("Auth", &msg));
        };
        if session.check_proof(
            Role::Client,
            &self.client_nonce,
            &self.server_nonce,
            &self.client,
            &a.proof,
        ) {
            Ok(self.client)
        } else {
            Err(Refusal::new(Error::BadToken, RefuseReason::BadToken))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::link::PeerCred;
    use baton_messages::SessionToken;

    fn cred() -> PeerCred {
        PeerCred {
            pid: std::process::id(),
            uid: rustix::process::geteuid().as_raw(),
            gid: 0,
        }
    }

    fn me_cred() -> KernelPeer {
        KernelPeer {
            cred: cred(),
            pidfd: None,
        }
    }

    #[test]
    fn matching_tokens_complete() {
        let s = Session::new(SessionToken::from_bytes([5; 32]));
        let (client, hello) = ClientHandshake::start(&s).unwrap();
        let (server, welcome) = ServerHandshake::on_hello(&s, &me_cred(), hello).unwrap();
        let (auth, server_id) = client.on_welcome(&s, &me_cred(), welcome).unwrap();
        assert_eq!(server_id, s.process());
        assert_eq!(server.on_auth(&s, auth).unwrap(), s.process());
    }

    #[test]
    fn a_wrong_token_is_refused_on_both_sides() {
        let good = Session::new(SessionToken::from_bytes([5; 32]));
        let bad = Session::new(SessionToken::from_bytes([6; 32]));
        // A client with the wrong token refuses the server's proof…
        let (client, hello) = ClientHandshake::start(&bad).unwrap();
        let (_, welcome) = ServerHandshake::on_hello(&good, &me_cred(), hello).unwrap();
        let r = client.on_welcome(&bad, &me_cred(), welcome).unwrap_err();
        assert!(matches!(r.error, Error::BadToken));
        // …and a server refuses a client whose proof was made with the wrong token.
        let (client, hello) = ClientHandshake::start(&good).unwrap();
        let (server, welcome) = ServerHandshake::on_hello(&bad, &me_cred(), hello).unwrap();
        // The client would refuse this server, but force an Auth made under `good`:
        let w = match welcome {
            Message::Welcome(w) => w,
            _ => unreachable!(),
        };
        let forged = Message::Welcome(Welcome {
            proof: good.proof(Role::Server, &client.nonce, &w.nonce, &w.process),
            ..w
        });
        let (auth, _) = client.on_welcome(&good, &me_cred(), forged).unwrap();
        let r = server.on_auth(&bad, auth).unwrap_err();
        assert!(matches!(r.error, Error::BadToken));
        assert_eq!(r.reason, Some(RefuseReason::BadToken));
    }

    #[test]
    fn version_and_order_faults_are_typed() {
        let s = Session::new(SessionToken::from_bytes([5; 32]));
        let (_, hello) = ClientHandshake::start(&s).unwrap();
        let Message::Hello(mut h) = hello else {
            unreachable!()
        };
        h.version = 42;
        let r = ServerHandshake::on_hello(&s, &me_cred(), Message::Hello(h)).unwrap_err();
        assert!(matches!(
            r.error,
            Error::Message(baton_messages::Error::UnsupportedVersion { got: 42, .. })
        ));
        let r = ServerHandshake::on_hello(&s, &me_cred(), Message::Ping(1)).unwrap_err();
        assert!(matches!(
            r.error,
            Error::UnexpectedMessage {
                expected: "Hello",
                got: "Ping"
            }
        ));
    }

    #[test]
    fn a_claimed_identity_must_match_the_socket() {
        let s = Session::new(SessionToken::from_bytes([5; 32]));
        let (_, hello) = ClientHandshake::start(&s).unwrap();
        let other = KernelPeer {
            cred: PeerCred { pid: 1, ..cred() },
            pidfd: None,
        };
        let r = ServerHandshake::on_hello(&s, &other, hello).unwrap_err();
        assert!(matches!(r.error, Error::PeerIdentityMismatch { .. }));
    }
}
