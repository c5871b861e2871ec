//! A short-lived admin link to a node: the ordinary link handshake (same uid, the session
//! token proven without sending it), then status requests.

use baton_ipc::{Link, LinkConfig, Session};
use baton_messages::protocol::{Status, StatusRequest, StatusScope};
use baton_messages::status::{NodeStatus, STATUS_VERSION};
use baton_messages::{Message, SessionToken};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What can go wrong talking to a node.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CliError {
    /// The token file is missing or unreadable.
    #[error(
        "cannot read the token file {path}: {source}\n  a node writes it beside its socket when it listens, readable only by its user: \
         run this as that user, or pass --token-file"
    )]
    TokenFile {
        /// Where it was looked for.
        path: PathBuf,
        /// Why it could not be read.
        source: std::io::Error,
    },
    /// The token file does not hold a token.
    #[error("{path} does not hold a session token (64 hex digits)")]
    BadTokenFile {
        /// The file.
        path: PathBuf,
    },
    /// The link could not be established (nobody listens, wrong token, wrong user…).
    #[error("cannot link to {path}: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: baton_ipc::Error,
    },
    /// The link failed after it was established.
    #[error("the link to the node failed: {0}")]
    Link(#[from] baton_ipc::Error),
    /// No answer in time.
    #[error("the node did not answer within {0:?}")]
    Timeout(Duration),
    /// The answer was not a status this command understands.
    #[error("the node's answer is not a status: {0}")]
    BadStatus(String),
}

/// Reads a session token from `path` (64 hex digits), refusing a file others may read.
///
/// # Errors
/// [`CliError::TokenFile`], [`CliError::BadTokenFile`].
pub fn read_token(path: &Path) -> Result<SessionToken, CliError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| CliError::TokenFile {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(err)?;
    if meta.permissions().mode() & 0o077 != 0 {
        return Err(err(std::io::Error::other(format!(
            "mode {:o}: readable by others, so not trusted (chmod 600 it)",
            meta.permissions().mode() & 0o777
        ))));
    }
    let text = std::fs::read_to_string(path).map_err(err)?;
    SessionToken::from_hex(&text).ok_or_else(|| CliError::BadTokenFile {
        path: path.to_owned(),
    })
}

/// The token file of the socket at `socket`: `<socket>.token`.
pub fn token_file_of(socket: &Path) -> PathBuf {
    let mut name = socket.as_os_str().to_owned();
    name.push(".token");
    PathBuf::from(name)
}

/// An authenticated link to a node, for status requests.
#[derive(Debug)]
pub struct AdminLink {
    link: Link,
    next_id: u64,
}

impl AdminLink {
    /// Links to the node listening at `socket`, proving the token read from `token_file`
    /// (default: `<socket>.token`).
    ///
    /// # Errors
    /// A token file error, or [`CliError::Connect`].
    pub fn connect(socket: &Path, token_file: Option<&Path>) -> Result<AdminLink, CliError> {
        let token_path = token_file.map_or_else(|| token_file_of(socket), Path::to_owned);
        let session = Session::new(read_token(&token_path)?);
        let link = Link::connect(socket, &LinkConfig::new(session)).map_err(|source| {
            CliError::Connect {
                path: socket.to_owned(),
                source,
            }
        })?;
        Ok(AdminLink { link, next_id: 1 })
    }

    /// Asks for the node's status (with `scope`, at most `limit` entries per list) and
    /// waits at most `within` for it. Answers the node's pings (and its own status
    /// requests, with a status of this process) meanwhile.
    ///
    /// # Errors
    /// [`CliError::Timeout`], [`CliError::Link`], [`CliError::BadStatus`].
    pub fn status(
        &mut self,
        scope: StatusScope,
        limit: u32,
        within: Duration,
    ) -> Result<NodeStatus, CliError> {
        let id = self.next_id;
        self.next_id += 1;
        self.link.send(
            &Message::StatusRequest(StatusRequest { id, scope, limit }),
            &[],
        )?;
        let start = Instant::now();
        loop {
            let left = within
                .checked_sub(start.elapsed())
                .filter(|d| !d.is_zero())
                .ok_or(CliError::Timeout(within))?;
            let received = match self.link.recv_timeout(left) {
                Ok(r) => r,
                Err(baton_ipc::Error::Timeout { .. }) => return Err(CliError::Timeout(within)),
                Err(e) => return Err(e.into()),
            };
            match received.message {
                Message::Status(Status {
                    id: got,
                    version,
                    json,
                }) if got == id => {
                    if version > STATUS_VERSION {
                        eprintln!(
                            "baton: the node writes status version {version}, this command reads {STATUS_VERSION}: fields may be missing"
                        );
                    }
                    return NodeStatus::from_json(&json)
                        .map_err(|e| CliError::BadStatus(e.to_string()));
                }
                Message::Ping(n) => self.link.send(&Message::Pong(n), &[])?,
                Message::StatusRequest(r) => {
                    // Another node asks for the tree and reaches us: say who we are.
                    let me = NodeStatus {
                        version: STATUS_VERSION,
                        pid: std::process::id(),
                        name: Some("baton (admin link)".to_owned()),
                        ..Default::default()
                    };
                    let json = me
                        .to_json()
                        .map_err(|e| CliError::BadStatus(e.to_string()))?;
                    self.link.send(
                        &Message::Status(Status {
                            id: r.id,
                            version: STATUS_VERSION,
                            json,
                        }),
                        &[],
                    )?;
                }
                // Nothing else is meant for an admin link; an answer to an earlier request
                // that timed out is dropped.
                _ => {}
            }
        }
    }
}
